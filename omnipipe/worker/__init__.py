"""Stage workers: load one stage, take submissions, hand tensors to the next stage."""
