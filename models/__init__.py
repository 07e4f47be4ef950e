"""Models on jax_flashcomm's tensor-parallel layers: the Llama family (:mod:`models.llama`), the
checkpoint formats it loads from (:mod:`models.checkpoints`), the tokenizer, the engine, and
the command lines (``.venv/bin/python -m models.generate``, ``models.eval``, ... sharing
:mod:`models.cli`). docs/models.md describes them."""
