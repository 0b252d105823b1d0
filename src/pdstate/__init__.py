"""pdstate: disaggregated prefill/decode state transfer for DeepSeek-V4 target + draft pools."""

__version__ = "0.1.0"
