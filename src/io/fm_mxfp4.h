/* MXFP4 (OCP Microscaling Formats v1.0, 2023: the MXFP4 block format), as the released gpt-oss
 * checkpoints store their experts (transformers' integrations/mxfp4.py, convert_moe_packed_tensors):
 * a tensor NAME is two uint8 tensors,
 *   NAME_blocks [..., G, 16]: two FP4 (E2M1) codes a byte, the low nibble first (value 2j from
 *     byte j's bits 0-3, value 2j+1 from bits 4-7), 32 values a block;
 *   NAME_scales [..., G]: one E8M0 exponent a block, the block's scale 2^(s - 127);
 * each row of G blocks holds G x 32 values. E2M1 codes 0..15 are +0, 0.5, 1, 1.5, 2, 3, 4, 6 and
 * their negatives (code + 8). Dequantized to fp32 exactly: a code (at most 2 significant bits)
 * times a power of two is representable in fp32 and in bf16 for every scale that keeps it finite
 * (s <= 252 for 6.0; 2^-127 x 0.5 is an fp32 and a bf16 subnormal, exact). */
#ifndef FM_MXFP4_H
#define FM_MXFP4_H

#include <stdint.h>

#include "../core/fm_core.h"
#include "fm_safetensors.h"

/* out [rows, G*32] fp32 = the values of blocks [rows, G, 16] with scales [rows, G]. Errors:
 * FM_ERR_FORMAT (naming `what`, the row and block) for a scale of 255 (E8M0's NaN) or one that
 * makes a value infinite. */
fm_status fm_mxfp4_dequant(float *out, const uint8_t *blocks, const uint8_t *scales, int64_t rows, int64_t G,
                           const char *what);

/* The bytes of U8 tensor `name` of file st, of the expected shape [ndim], into dst. Errors:
 * FM_ERR_FORMAT (missing, another dtype or shape: expected and found), FM_ERR_IO. */
fm_status fm_st_read_u8(const fm_safetensors *st, const char *name, uint8_t *dst, int ndim, const int64_t *shape);

#endif
