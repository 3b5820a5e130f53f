"""Where a piece lands: a rank's local piece, boxes and flat runs of a tensor, turned into extents.

What the readers and save_pretrained (live/) share: a DTensor's placements and DeviceMesh read as
the boxes its local piece fills (placements, mesh_ranks), the pieces ranks hold twice
(local_pieces), and boxes or flat vectors cut into a plan's extents (boxes, flat_runs).
Metadata only: nothing here reads a tensor's bytes.
"""
