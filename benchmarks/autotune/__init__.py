"""The automatic choice: is ``auto`` as fast as the best fixed setting (:mod:`.auto_vs_fixed`),
and how well two tuning tables of one machine agree (:mod:`.table_repeat`)."""
