"""What training minimises: ``schedule`` (the log-linear noise schedule, antithetic times, masking),
``losses`` (SUBS, the MDLM NELBO, ADLM's ANELBO, the AR NLL), ``vocab_loss`` (those losses fused with the vocabulary
projection, without the float32 logits). BD3-LM's and SEDD's objectives sit with their kinds in ``baselines``;
self-distillation's in ``train.distill``."""
