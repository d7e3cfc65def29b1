"""CloverLM (IST-DASLab): the architecture in plain PyTorch (`reference`) and checkpoints in its format
(`checkpoint`), what the vLLM port is checked against."""
