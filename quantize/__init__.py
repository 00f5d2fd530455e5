"""Weight quantization: RTN, GPTQ, AWQ, FP8 and INT8 (SmoothQuant), the `vserve quantize` pipeline, and the AutoAWQ
GEMM, GPTQ and compressed-tensors checkpoint layouts."""
