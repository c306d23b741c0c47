"""The text layer between the engine's token ids and every API: detokenizing and stop strings
(`detokenize`), the reasoning split and the reply parser (`reasoning`), tool calls in the model's
format (`tool_calls`) and the typed values they carry (`schema_values`). No torch, no HTTP."""
