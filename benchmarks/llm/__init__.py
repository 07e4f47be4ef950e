"""The collectives in a real model (SmolLM2-135M): accuracy (:mod:`.accuracy` and its page,
:mod:`.accuracy_page`; per-site sensitivity, :mod:`.layer_sensitivity`; FP8 / FP4 formats
simulated in :mod:`.fp_formats` and probed on the model by :mod:`.format_probe`; the scoring
they share, :mod:`.scoring`) and time to first token (:mod:`.ttft`)."""
