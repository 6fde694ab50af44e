"""The backends: the two implementations of every computation behind one protocol (``protocol.Backend``): the Triton
kernels (``triton_backend``) and their chunked-torch twins (``torch_backend``, over ``head_twin``, ``token_loss_twin``
and ``divergence_twin``), resolved once per call (``resolver``)."""
