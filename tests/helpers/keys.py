"""A Hypothesis strategy for a request's extra keys as validation lets them through: an
optional LoRA (name and path), a salt (None, empty or set), and up to ``max_inputs``
multimodal placeholders, sorted by offset and apart."""

from __future__ import annotations

from hypothesis import strategies as st

from pagekeeper.core.types import ExtraKeys, MultiModalKey


@st.composite
def extra_keys(draw: st.DrawFn, max_inputs: int = 12) -> ExtraKeys:
    spots = draw(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 40)), max_size=max_inputs))
    mm, offset = [], 0
    for gap, length in spots:
        mm.append(MultiModalKey(f"img-{offset}", offset + gap, length))
        offset += gap + length
    lora = draw(st.booleans())
    return ExtraKeys(
        lora_name="a" if lora else None,
        lora_path="/a" if lora else None,
        mm_inputs=tuple(mm),
        cache_salt=draw(st.sampled_from([None, "", "s"])),
    )
