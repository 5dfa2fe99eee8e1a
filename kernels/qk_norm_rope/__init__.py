"""Wan's query/key RMSNorm and rotary embedding in one pass over q (or k):

    y[t] = rotate(RMSNorm(x[t]) · w, position(t))          (RMSNorm over the whole hidden, all heads)

where rotate turns each (even, odd) channel pair of every head by the token's angle. Under torch.compile,
inductor fuses the two into one kernel, but it reads each row's pairs back from memory with gathered indices
(a pair's output needs both of its inputs) and spends about three times the bytes' time. Here one program
owns one token row: it loads the row once, contiguous, splits it into even and odd channels in registers
(``tl.split``), reduces, normalises, rotates, and stores the pairs joined again (``tl.join``), contiguous.
"""
