"""Configuration class of the Kimi-K2.5 stand-in, loaded through ``config.json``'s
``auto_map`` (so only with ``trust_remote_code=True``), as the hub's
``configuration_kimi_k25.py`` is.

Written for eaglet's tests from the published shape of Kimi-K2.5's configuration, not from
its code: a multimodal wrapper (``model_type`` ``kimi_k25``) whose language model is a
DeepSeek-V3 configuration in ``text_config`` (the file says ``model_type`` ``kimi_k2``
there; the loaded object is transformers' ``DeepseekV3Config``), a vision tower described
in ``vision_config``, the media placeholder token id, and the language model's
``quantization_config`` repeated on the wrapper, where quantization loaders look first.
"""

from __future__ import annotations

from transformers import DeepseekV3Config, PretrainedConfig


class KimiK25VisionConfig(PretrainedConfig):
    """The vision tower and projector, under the field names Kimi's config.json uses."""

    model_type = "kimi_k25_vision"

    def __init__(
        self,
        patch_size: int = 14,
        vt_hidden_size: int = 1152,
        vt_intermediate_size: int = 4304,
        vt_num_attention_heads: int = 16,
        vt_num_hidden_layers: int = 27,
        merge_kernel_size=(2, 2),
        mm_hidden_size: int = 1152,
        text_hidden_size: int = 7168,
        **kwargs,
    ):
        self.patch_size = patch_size
        self.vt_hidden_size = vt_hidden_size
        self.vt_intermediate_size = vt_intermediate_size
        self.vt_num_attention_heads = vt_num_attention_heads
        self.vt_num_hidden_layers = vt_num_hidden_layers
        self.merge_kernel_size = list(merge_kernel_size)
        self.mm_hidden_size = mm_hidden_size
        self.text_hidden_size = text_hidden_size
        super().__init__(**kwargs)


class KimiK25Config(PretrainedConfig):
    """Kimi-K2.5: a DeepSeek-V3 language model (``text_config``) behind a vision tower."""

    model_type = "kimi_k25"

    def __init__(
        self,
        text_config=None,
        vision_config=None,
        media_placeholder_token_id: int = 163605,
        ignore_index: int = -100,
        use_unified_vision_chunk: bool = False,
        video_placeholder: str = "<|kimi_k25_video_placeholder|>",
        **kwargs,
    ):
        if isinstance(text_config, dict):
            text_config = DeepseekV3Config(
                **{k: v for k, v in text_config.items() if k != "model_type"}
            )
        self.text_config = text_config if text_config is not None else DeepseekV3Config()
        if isinstance(vision_config, dict):
            vision_config = KimiK25VisionConfig(**vision_config)
        self.vision_config = vision_config if vision_config is not None else KimiK25VisionConfig()
        self.media_placeholder_token_id = media_placeholder_token_id
        self.ignore_index = ignore_index
        self.use_unified_vision_chunk = use_unified_vision_chunk
        self.video_placeholder = video_placeholder
        quantization = getattr(self.text_config, "quantization_config", None)
        if quantization is not None:
            self.quantization_config = quantization
        super().__init__(**kwargs)

    @property
    def hidden_size(self) -> int:
        """The language model's width, which code written for plain LMs asks the wrapper."""
        return self.text_config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size
