"""Tensor parallelism over ``torch.distributed``: every rank holds its slice of each layer and runs the same steps."""
