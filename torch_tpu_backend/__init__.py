"""ctpu's PyTorch surface: the `ctpu` dynamo backend, the `ctpu` device, the runtime and the command line.

Kept import-light: `import torch_tpu_backend` does not import torch; each capability imports what it needs.
"""
