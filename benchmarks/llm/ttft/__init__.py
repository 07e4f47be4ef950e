"""Time to first token (and decode) of SmolLM2 at TP=3: ranks as processes on emulated links
(:mod:`.links`; each process runs :mod:`.links_worker`, which sets and checks the links through
:mod:`.link_control`), ranks as the devices of one process on the p2p transport (:mod:`.p2p`),
and what they share (:mod:`.settings`: strategies, links, FLOPs and bytes per step;
:mod:`.report`: the tables and the plot of a run)."""
