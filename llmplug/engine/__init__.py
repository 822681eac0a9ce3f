"""The runtime: attention metadata, llmplug's attention function, the model runner and the generate loop."""
