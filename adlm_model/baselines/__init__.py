"""The baselines whose network, objective and sampler are one concept, a module each: ``bd3lm`` (block
diffusion: objective, clipped schedules, block sampler), ``sedd`` (SEDD: the score network, score entropy, the
predictors), ``ssdlm`` (SSD-LM: the released RoBERTa simplex network and its block sampler; sample-only)."""
