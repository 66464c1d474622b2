"""The row-wise optimizers of the fused backward-and-step kernels (:mod:`rmt.ops.fused_update`),
as the integer codes every backend's ``backward_update`` takes. A leaf: the front, the fused
update and the backends all read them here."""

SPARSE_ADAM, ROWWISE_ADAGRAD = 0, 1
