"""The model class of an rmt model exported by ``rmt-export`` (``trust_remote_code=True``):
rmt's own module, so rmt must be installed (see ``rmt.export.hf_model`` for why)."""

from rmt.export.hf_model import RMTForCausalLM  # noqa: F401
