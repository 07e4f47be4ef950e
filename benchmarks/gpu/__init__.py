"""GPUs: the GPU check's measurements (:mod:`.check`, run by ``bash benchmarks/gpu_check.sh``),
the CUDA quantize kernels by group size (:mod:`.codec_speed`), and the cost model of the
all-reduce and TTFT on GPUs (:mod:`.cost_model`, no GPU needed)."""
