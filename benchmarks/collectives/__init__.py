"""The collectives: the quantized all-reduce's speed (:mod:`.allreduce_speed`, on each
transport: :mod:`.allreduce_p2p`, :mod:`.allreduce_shm`), its error (:mod:`.allreduce_error`),
calls in flight (:mod:`.allreduce_inflight`), the exact bf16 baseline (:mod:`.bf16_baseline`),
the all-gather ring (:mod:`.all_gather_ring`), the ring matmuls' overlap
(:mod:`.matmul_overlap_gloo`, :mod:`.matmul_overlap_p2p`) and the fused epilogue
(:mod:`.fused_norm`)."""
