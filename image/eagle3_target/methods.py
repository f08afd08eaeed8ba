"""The draft methods a served target feeds: which layers and which last hidden state each needs, and the
default layer ids the trainers compute, converted to this project's convention.

Our convention (HF ids): layer id i is the output of decoder layer i; L-1, the last one, is taken *before*
the final norm (`final="prenorm"` is that same state; `"postnorm"` is the norm's output, what the LM head
reads). The trainers count differently, and the conversions live here:

- speculators 0.9 counts in vLLM capture ids: k is the residual entering decoder layer k, our k-1, and N
  (`num_hidden_layers`) is the pre-norm last state. Its files always end with that state (its dataset reads
  the last slot as `verifier_last_hidden_states` and applies the verifier's norm itself).
- NeMo AutoModel 0.7.0's EAGLE-3 and DFlash targets count like us (forward hooks on the decoder layers, so
  L-1 is before the norm); its DSpark target reads id L-1 after the final norm, which is DSpark's `final`
  state here ("postnorm"), so its default ids leave L-1 out.

Torch-free: the export command line reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from eagle3_target.protocol import FinalState

# How many layers DFlash and DSpark drafts read by default: NeMo's `draft_num_hidden_layers` default (5),
# which is also their feature-layer count (DeepSpec's and z-lab's Qwen3-8B drafts: [1, 9, 17, 25, 33]).
DFLASH_FEATURE_LAYERS = 5


def eagle3_layer_ids(num_hidden_layers: int) -> list[int]:
    """speculators' default `[2, N//2, N-3]` (vLLM ids), minus 1: `[1, L//2-1, L-4]`, which is NeMo's and
    SpecForge's EAGLE-3 recipe too."""
    return hf_layer_ids([2, num_hidden_layers // 2, num_hidden_layers - 3], num_hidden_layers)


def dflash_layer_ids(num_hidden_layers: int, count: int = DFLASH_FEATURE_LAYERS) -> list[int]:
    """NeMo's DFlash spread (`dflash.draft_qwen3.build_target_layer_ids`): `count` ids from 1 to L-3, rounded
    half to even. speculators has no DFlash default of its own (it falls back to EAGLE-3's three)."""
    if count == 1:
        return [num_hidden_layers // 2]
    span = num_hidden_layers - 4
    return [round(1 + i * span / (count - 1)) for i in range(count)]


def dspark_layer_ids(num_hidden_layers: int, count: int = DFLASH_FEATURE_LAYERS) -> list[int]:
    """NeMo's DSpark spread (`dspark.registry.build_target_layer_ids`): up to `count` distinct ids from 1 to
    L-1, without L-1: NeMo reads that id after the final norm, which is DSpark's `final` state here."""
    last = num_hidden_layers - 1
    count = max(1, min(count, last))
    if count == 1:
        spread = {last}
    else:
        step = (last - 1) / (count - 1)
        spread = {round(1 + i * step) for i in range(count)}
    return sorted(spread - {last})


def no_layers(num_hidden_layers: int) -> list[int]:
    """MTP: speculators' `target_layer_ids` is `[N]`, only the pre-norm last state (its `final`)."""
    return []


@dataclass(frozen=True)
class Method:
    """A draft method: how many feature layers its trainers default to (DSpark's count includes L-1, read
    after the norm: its `final` state here), the last hidden state `final` it trains on (speculators files
    always end with the pre-norm one and normalise it themselves) and its trainers' default layer ids."""

    name: str
    layers: int
    final: FinalState
    defaults: Callable[[int], list[int]]

    def default_layer_ids(self, num_hidden_layers: int) -> list[int]:
        """The trainers' default layers for a target of this depth, in our HF ids (ascending)."""
        ids = self.defaults(num_hidden_layers)
        if len(set(ids)) != len(ids) or any(not 0 <= i < num_hidden_layers for i in ids):
            raise ValueError(
                f"{self.name}'s default layers {ids} do not fit a target with {num_hidden_layers} layers; "
                "give the layer ids explicitly"
            )
        return ids


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("eagle3", 3, "prenorm", eagle3_layer_ids),
        Method("peagle", 3, "prenorm", eagle3_layer_ids),
        Method("dflash", DFLASH_FEATURE_LAYERS, "prenorm", dflash_layer_ids),
        Method("dspark", DFLASH_FEATURE_LAYERS, "postnorm", dspark_layer_ids),
        Method("mtp", 0, "prenorm", no_layers),
    )
}


def method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown draft method {name!r}; known: {', '.join(METHODS)}") from None


def hf_layer_ids(vllm_ids: Sequence[int], num_hidden_layers: int) -> list[int]:
    """Our ids for vLLM capture ids (speculators' `--target-layer-ids`): k -> k-1; N -> L-1, the pre-norm
    last state. vLLM's id 0 (the embeddings) has no counterpart here."""
    bad = [k for k in vllm_ids if not 1 <= k <= num_hidden_layers]
    if bad:
        raise ValueError(
            f"vLLM capture ids {bad} cannot be served: a target with {num_hidden_layers} layers serves ids "
            f"1..{num_hidden_layers} (0, the embeddings, is not captured)"
        )
    return [k - 1 for k in vllm_ids]


def vllm_capture_ids(layer_ids: Sequence[int]) -> list[int]:
    """speculators' `--target-layer-ids` for our layer ids, ascending as vLLM keeps them."""
    return sorted(i + 1 for i in layer_ids)
