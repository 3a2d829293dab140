"""Names shared by the decoder, the sharding rules and the sampler: a leaf module, so that those import
one way (each imports this) instead of each other.

Parameter names are logical axes of each weight; activation names differ from parameter names where a
mesh axis may split one but not the other (MaxText's split): the "embed" dimension of weights goes over
"fsdp", a hidden vector's does not."""

MESH_AXES = ("data", "fsdp", "model")
ROW_AXES = ("data", "fsdp")  # rows of a batch are split over both

LINEAR_NAMES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")

# Logical axes of each layer parameter, without the leading "layers" axis nn.scan adds. q/k/v/o are
# stored with heads and head_dim merged ([D, H*hd]); splitting that axis over "model" splits whole
# heads whenever the head count divides.
LAYER_AXES = {
    "attn_norm": ("norm",), "mlp_norm": ("norm",),
    "wq": ("embed", "heads"), "wk": ("embed", "kv_heads"), "wv": ("embed", "kv_heads"),
    "wo": ("heads", "embed"),
    "bq": ("heads",), "bk": ("kv_heads",), "bv": ("kv_heads",),
    "q_norm": ("head_dim",), "k_norm": ("head_dim",),
    "w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed"),
}
TOP_AXES = {"embed": ("vocab", "embed"), "final_norm": ("norm",), "lm_head": ("embed", "vocab")}

ACT_HIDDEN = ("batch", "length", "act_embed")
ACT_HEADS = ("batch", "length", "act_heads")
ACT_MLP = ("batch", "length", "act_mlp")
ACT_LOGITS = ("batch", "length", "act_vocab")
