"""Framework adapters, one package per framework: ``agl.integrations.<framework>``."""
