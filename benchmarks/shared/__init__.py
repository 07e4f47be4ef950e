"""What the benchmarks share: how a benchmark process runs (:mod:`.runtime`), its timing loops
(:mod:`.timing`), multi-process jobs on a rate-limited loopback (:mod:`.netns`), where results
go (:mod:`.results`) and the generated blocks of hand-written pages (:mod:`.pages`)."""
