"""kvrows.persist: saved state on disk.

* ``files``: crash-safe safetensors files (atomic replace, fsync, a checksum per file,
  ``CorruptStateError`` for anything truncated, flipped or mismatched);
* ``prompt_cache``: ``save_prompt_cache`` / ``load_prompt_cache`` for lists of caches of
  either implementation, in mlx-lm's prompt-cache file format (files interoperate both
  ways for the storages mlx-lm has) with kvrows' own metadata (signature-keyed forms,
  format version, checksum);
* ``prefix_store``: token prefixes on disk, by block hash chain, under a byte budget;
* ``transfer``: caches and rows sent between processes over ``mlx.distributed`` in the
  prompt-cache file's form (planes as stored, nothing decoded).
"""
