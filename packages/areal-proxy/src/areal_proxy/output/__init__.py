"""What happens to an engine's output: stop strings, tool-call and reasoning parsers, the schema check, OpenAI shapes."""
