KNOWN_FAILURES: dict[str, str] = {}
