"""A decoder layer's other ops: norms, rotary and activations, and the one-call fused decode step."""
