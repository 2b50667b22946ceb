"""Built-in policies, found through the `headrace.policies` entry points like any plugin."""
