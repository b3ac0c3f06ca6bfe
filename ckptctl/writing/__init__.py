"""How ckptctl writes and deletes a checkpoint so that a crash leaves nothing that looks
valid: output folders marked until committed, the manifest last, deletion marker first,
one output written by many processes.

Imports catalog, formats, storage and the foundations."""
