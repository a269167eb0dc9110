"""The workflow's stages: generate, extract, train, evaluate, scaling. A stage never imports a
tool."""
