"""The collectives in a real model (SmolLM2-135M): accuracy (:mod:`.accuracy` and its page,
:mod:`.accuracy_page`; per-site sensitivity, :mod:`.layer_sensitivity`; simulated FP formats,
:mod:`.format_probe`; the scoring they share, :mod:`.scoring`) and time to first token
(:mod:`.ttft`)."""
