"""q/k RMSNorm and rotary embedding in one pass over q (or k):

    y[t] = rotate(RMSNorm(x[t]) · w, position(t))

with the norm over the whole hidden (Wan: ``torch.nn.RMSNorm(heads · head_dim)``) or over each head
(Qwen-Image, Z-Image: diffusers' ``RMSNorm(head_dim)``), and rotate turning each head's (even, odd) channel
pairs by the token's angle: from Wan's cos/sin tables (each pair's value repeated) or from a complex table
(Qwen-Image's and Z-Image's ``freqs_cis``, read as its (real, imaginary) pairs). Under torch.compile,
inductor fuses the two into one kernel but reads each row's pairs back from memory with gathered indices (a
pair's output needs both of its inputs) and spends about three times the bytes' time. Here one program owns
one token row: it loads the row once, contiguous, as [heads, head_dim], splits the channels into even and
odd in registers (``tl.split``), reduces, normalises, rotates, and stores the pairs joined again
(``tl.join``), contiguous.
"""
