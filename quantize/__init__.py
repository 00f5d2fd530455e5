"""Weight quantization: RTN, GPTQ and AWQ for one linear layer, and the AWQ/GPTQ checkpoint layouts."""
