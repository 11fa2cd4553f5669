"""Constrained decoding with llguidance: request guidance specs and their transactional matchers."""

from pagedgen.guidance.spec import GUIDANCE_KINDS, GuidanceSpec, compile_guidance

__all__ = ["GUIDANCE_KINDS", "GuidanceSpec", "compile_guidance"]
