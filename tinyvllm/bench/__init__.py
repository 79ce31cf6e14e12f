"""`python -m tinyvllm.bench`: the bandwidth-roofline benchmark."""
