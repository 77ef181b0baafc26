"""Quantize-on-load: which format each tensor of a float checkpoint gets, following llama.cpp's
rules for a model quantized without an importance matrix:

- every linear layer of the decoder (q, k, v, o, gate, up, down) takes the requested format;
  where its rows do not hold a whole number of blocks, the format llama.cpp falls back to
  (see `FALLBACK`);
- the output projection (lm_head, or the embedding table when the two are tied) takes Q6_K,
  or Q8_0 when its rows do not fit Q6_K (unless the requested format is Q8_0, which it keeps);
  a separate input embedding table takes the requested format;
- norms and biases stay in the model's dtype.

With ``quantize_lm_head=False`` the embedding table and lm_head stay in the model's dtype.
The mixtures of llama.cpp's file types (``MIXTURES``): ``"q4_k_m"`` / ``"q5_k_m"`` (Q4_K_M,
Q5_K_M): Q4_K (Q5_K), with the v projection and the MLP's down projection of the layers
`use_more_bits` picks in Q6_K; ``"q4_k_s"`` (Q4_K_S): Q4_K, with the v projection of the first 4
layers and the down projection of the first eighth in Q5_K; ``"q5_k_s"`` (Q5_K_S): Q5_K, the
same as ``"q5_k"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pyengine.quant.formats import QuantFormat, quant_format
from pyengine.quant.weight import QuantizedWeight

__all__ = ["QuantPlan", "FALLBACK", "LINEAR_SUFFIXES", "MIXTURES", "use_more_bits"]

#: the names (suffixes) of a decoder layer's linear weights
LINEAR_SUFFIXES = _LINEAR_SUFFIXES = tuple(f"self_attn.{p}_proj.weight" for p in "qkvo") + tuple(
    f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
_EMBED = "model.embed_tokens.weight"
_LM_HEAD = "lm_head.weight"

# The format a tensor takes when its rows do not fit the requested one (llama.cpp's choices).
FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0", "q5_0": "q8_0", "q5_1": "q8_0", "q4_0": "q8_0",
            "q4_z": "q8_0", "q8_0": None}


#: quantization methods that are mixtures (llama.cpp's file types): name -> its base format
MIXTURES = {"q4_k_s": "q4_k", "q4_k_m": "q4_k", "q5_k_s": "q5_k", "q5_k_m": "q5_k"}


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's choice of the layers whose v projection and MLP down projection a Q4_K_M or
    Q5_K_M model keeps in Q6_K: the first and last eighth of the layers, and every third one
    between."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


@dataclass
class QuantPlan:
    """The formats of one model's tensors, decided from names and shapes as tensors load."""

    method: QuantFormat
    tied_embeddings: bool
    quantize_lm_head: bool = True
    # Q4_K_M, Q5_K_M: some layers' v and down projections in Q6_K (use_more_bits); needs num_layers
    more_bits: bool = False
    num_layers: int = 0
    # Q4_K_S: the first layers' v and down projections in Q5_K; needs num_layers
    first_layers_q5_k: bool = False
    # the output projection's format (lm_head, or the embedding table when tied) in place of
    # llama.cpp's choice; None: that choice (llama-quantize's --output-tensor-type)
    output_format: str | None = None
    # tensor name -> format name, or the reason it stayed in the model's dtype
    report: dict[str, str] = field(default_factory=dict)

    @classmethod
    def create(cls, method: str, tied_embeddings: bool, quantize_lm_head: bool = True,
               num_layers: int = 0, output_format: str | None = None) -> "QuantPlan":
        """`method`: a format name, or one of MIXTURES (llama.cpp's file types). `output_format`: a
        format name for the output projection instead of llama.cpp's choice."""
        output = None if output_format is None else quant_format(output_format).name
        if method in MIXTURES:
            return cls(quant_format(MIXTURES[method]), tied_embeddings, quantize_lm_head,
                       more_bits=method.endswith("_m"), num_layers=num_layers,
                       first_layers_q5_k=method == "q4_k_s", output_format=output)
        return cls(quant_format(method), tied_embeddings, quantize_lm_head, output_format=output)

    def wanted_format(self, name: str, shape: tuple[int, ...]) -> str | None:
        """The format llama.cpp's rules give tensor `name`, before any fallback for rows that do
        not fit it; None: it stays in the model's dtype."""
        if len(shape) != 2:
            return None
        if name.endswith(("self_attn.v_proj.weight", "mlp.down_proj.weight")):
            layer = int(name.split(".")[2])  # model.layers.<i>.
            if self.more_bits and use_more_bits(layer, self.num_layers):
                return "q6_k"
            # llama.cpp's Q4_K_S: v of the first 4 layers, down of the first eighth
            if self.first_layers_q5_k and layer < (4 if "v_proj" in name else self.num_layers // 8):
                return "q5_k"
        is_output = name == _LM_HEAD or (name == _EMBED and self.tied_embeddings)
        if is_output or name == _EMBED:
            if not self.quantize_lm_head:
                return None
            if is_output and self.output_format is not None:
                return self.output_format
            return "q6_k" if is_output and self.method.name != "q8_0" else self.method.name
        if name.endswith(_LINEAR_SUFFIXES):
            return self.method.name
        return None

    def format_for(self, name: str, shape: tuple[int, ...]) -> QuantFormat | None:
        """The format for tensor `name` of `shape` (the wanted one, or its fallback where the rows
        do not fit it), or None to keep it in the model's dtype."""
        wanted = self.wanted_format(name, shape)
        return None if wanted is None else self._fitting(wanted, shape[1])

    def _fitting(self, name: str, k: int) -> QuantFormat | None:
        while name is not None:
            fmt = quant_format(name)
            if fmt.fits(k):
                return fmt
            name = FALLBACK[name]
        return None

    def convert(self, name: str, tensor: torch.Tensor) -> torch.Tensor | QuantizedWeight:
        """`tensor` quantized if the plan says so (recording what was done in `report`)."""
        shape = tuple(tensor.shape)
        wanted = self.wanted_format(name, shape)
        fmt = None if wanted is None else self._fitting(wanted, shape[1])
        if fmt is None:
            if len(shape) == 2:
                self.report[name] = "kept (quantize_lm_head=False)" if not self.quantize_lm_head else \
                    f"kept (rows of {shape[1]} fit no format)"
            # a copy: a tensor read from a safetensors file may view its memory map, which would
            # keep the whole file's pages resident next to the quantized weights
            return tensor.clone()
        # a format asked for (the linear layers', an output format given) that the rows do not fit
        fell_back = fmt.name != wanted and (name.endswith(_LINEAR_SUFFIXES) or wanted == self.output_format)
        self.report[name] = f"{fmt.name} (rows of {shape[1]} weights)" if fell_back else fmt.name
        return QuantizedWeight.quantize(tensor, fmt)

    def summary(self) -> dict[str, int]:
        """How many tensors took each format (or stayed unquantized)."""
        counts: dict[str, int] = {}
        for v in self.report.values():
            key = v.split(" ")[0]
            counts[key] = counts.get(key, 0) + 1
        return counts
