"""retropipe.launch: the entry points users type (prepare_data, build_index, train, evaluate,
generate, convert_gpt2, demo), the config composed from every package's section, and the Ray
adapter. The only package that imports all the others.
"""
