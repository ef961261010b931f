"""TransformerEngine's debug config that keeps layers out of quantisation: the decision of
``ampdoctor fp8`` exported to the tool that trains (issue 42). ``DisableFP8Layer`` is the
feature's name in every TransformerEngine with the debug API (newer releases keep it as an alias
of ``DisableQuantizationLayer``, which covers MXFP8 and NVFP4 as well); its layers are chosen by a
regular expression over the names nvdlfw-inspect gives them."""

from __future__ import annotations

import re


def te_debug_config(names: list[str], quantization: str = "FP8") -> str:
    """TransformerEngine's debug API config (the YAML that ``debug_api.initialize(config_file=)``
    of nvdlfw-inspect reads) that keeps the layers ``names`` (fully qualified module names) out of
    ``quantization`` (a name: ``FP8``, ``mxfp8``, ``nvfp4``): one section whose ``DisableFP8Layer``
    feature applies to a regular expression matching exactly the names nvdlfw-inspect gives them when it infers them
    (``debug_api.infer_and_assign_layer_names(model)``: ``model`` for the model itself, ``model.``
    and the qualified name below it; it searches each layer's name with the expression)."""
    inferred = ["model" if n == "" else "model." + n for n in names]
    pattern = "^(?:" + "|".join(re.escape(n) for n in inferred) + ")$"
    quoted = "'" + pattern.replace("'", "''") + "'"  # (YAML's single quotes: backslashes stay as they are)
    section = "ampdoctor_keep_out_of_" + re.sub(r"\W", "_", quantization.lower())
    return (f"# ampdoctor fp8: the layers to keep out of {quantization} (TransformerEngine debug API)\n"
            f"{section}:\n"
            "  enabled: True\n"
            "  layers:\n"
            f"    layer_name_regex_pattern: {quoted}\n"
            "  transformer_engine:\n"
            "    DisableFP8Layer:\n"
            "      enabled: True\n")
