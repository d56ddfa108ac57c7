"""The symbolic engine: tensors as sizes (`tape`), ops that record what PyTorch saves and allocates (`ops`),
and compiled programs of allocation events evaluated for any batch shape (`program`)."""
