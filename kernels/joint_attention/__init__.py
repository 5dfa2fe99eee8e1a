"""Joint attention of two token streams without concatenating them (SD3 / SD3.5's MM-DiT blocks):

    [image out; text out] = softmax([q_img; q_txt] · [k_img; k_txt]ᵀ / √d) · [v_img; v_txt]

per head. diffusers builds the joint sequence with ``torch.cat`` for q, k and v, attends, transposes the
output back and slices it into the two streams (each slice copied again as its output projection's
input). Here each stream's q, k, v stay where their projections wrote them ([batch, tokens, heads · head_dim],
rows possibly a slice of a wider projection's output): one program owns a tile of one stream's queries of
one (batch, head), runs the online softmax over every image key and then every text key, and writes its
rows into that stream's own output, which the output projection reads as it is. Loads and stores go through
TMA descriptors: rows past a stream's end load as zeros (their scores masked) and are not stored.
"""
