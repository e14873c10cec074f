"""The pilot model of DyNN-Offload: idiom features (AFM), the predictor of execution blocks,
its training-data generator and trainer, ONNX export and the ``pilot_model_inference`` op.

Nothing here yet: the pilot arrives with the dynamic-networks issue. The package exists so the
dependency direction (``ort_offload`` → ``pilot``) is fixed from the start.
"""
