"""The Triton kernels, their tile tables (a row per GPU architecture class) and launch configurations: layer 1's
forward and backward, the frozen head, the GRPO token loss and the divergence head, with the records they merge;
nothing here imports the package above it."""
