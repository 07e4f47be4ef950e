"""Time to first token (and decode) of SmolLM2 at TP=3: ranks as processes on emulated links
(:mod:`.links`, each process :mod:`.links_worker`), ranks as the devices of one process on the
p2p transport (:mod:`.p2p`), and what both share (:mod:`.settings`: strategies, links, FLOPs
and bytes per step; :mod:`.report`: tables and plot)."""
