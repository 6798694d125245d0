"""The networks, torch only: ``attention`` (flash-attn or SDPA), ``backbone`` (the DiT: rotary, adaLN, KV
cache), ``block_attention`` (BD3-LM's masks and its pass over ``x_t ++ x_0``), ``models`` (MDLM, ADLM's anchor and
denoiser, AR). An export ships these modules (``interop.pretrained``): they import only torch and each other."""
