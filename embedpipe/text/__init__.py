"""Text to tokens: the tokenizer wrapper and the length-sorted packer."""
