"""Data preparation's machinery (the CLI is ``pipelines/prepare_data.py``).

``sources`` (named Hugging Face sets, local files; units of work), ``hub`` (named sets read as the hub's
Parquet files, or a mirror of them), ``embedded`` (the offline corpus), ``detokenizers``, ``tokenizer`` (load
or train; offline GPT-2/BERT), ``encoder`` (documents -> ids on tiktoken or tokenizers), ``plan`` (options and
everything checked before Ray), ``worker`` (a tokenizer actor: one unit read, packed, written, counted),
``prepare`` (the Ray Data stage and one split end to end), ``shards`` (packing, Parquet bytes, unit records,
resumption), ``manifest`` (what a split holds), ``reader`` (rows back from shards).
"""
