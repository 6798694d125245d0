"""Files in and out: ``checkpoint`` (safetensors + JSON, never pickle), ``pretrained`` (the Hugging Face-style
export folder) with ``configuration_adlm`` and ``modeling_adlm`` (the ``transformers`` wrappers it ships; never
imported by this package), ``reference_layouts`` / ``reference_sources`` / ``sedd_layout`` (the released checkpoints'
layouts mapped onto our networks), ``safe_pickle`` (the references' pickled files read without running them)."""
