"""The codec alone: its CPU kernels' speed (:mod:`.cpu_speed`, :mod:`.fp_speed`,
:mod:`.compare_builds`) and its format's design choices measured (:mod:`.zero_dtype`,
:mod:`.outliers`)."""
