"""`save_pretrained` from a live FSDP2 or FSDP1 model (live.save): the plan from the model's own
metadata (live.plan, live.fsdp1), agreed between ranks (live.agree), each rank's pieces written in
place (live.write)."""
