"""The samplers of the networks, at the token level: ``samplers`` (MDLM with caching, ReMDM-loop, nucleus, the
pieces every diffusion sampler shares), ``ar_sampling`` (AR: KV cache, a sliding window past the context),
``confidence`` (confidence-threshold parallel decoding in blocks), ``block_cache`` (the approximate prefix / dual
KV cache of the bidirectional networks). Text in, text out is ``inference``."""
