/* types.c - the block geometry of every tensor type GGUF can name. */
#include "types.h"

#define T(id, nm, be, bb, ok) [id] = { nm, be, bb, ok }

static const struct kern_type_info type_table[KERN_TYPE_LIMIT] = {
    T(KERN_F32, "F32", 1, 4, true),
    T(KERN_F16, "F16", 1, 2, true),
    T(KERN_Q4_0, "Q4_0", 32, 18, true),
    T(KERN_Q4_1, "Q4_1", 32, 20, true),
    T(KERN_Q5_0, "Q5_0", 32, 22, true),
    T(KERN_Q5_1, "Q5_1", 32, 24, true),
    T(KERN_Q8_0, "Q8_0", 32, 34, true),
    T(KERN_Q8_1, "Q8_1", 32, 36, false),
    T(KERN_Q2_K, "Q2_K", 256, 84, false),
    T(KERN_Q3_K, "Q3_K", 256, 110, false),
    T(KERN_Q4_K, "Q4_K", 256, 144, true),
    T(KERN_Q5_K, "Q5_K", 256, 176, true),
    T(KERN_Q6_K, "Q6_K", 256, 210, true),
    T(KERN_Q8_K, "Q8_K", 256, 292, false),
    /* 16..23: the IQ family, which kvd does not read */
    T(16, "IQ2_XXS", 256, 66, false),
    T(17, "IQ2_XS", 256, 74, false),
    T(18, "IQ3_XXS", 256, 98, false),
    T(19, "IQ1_S", 256, 50, false),
    T(20, "IQ4_NL", 32, 18, false),
    T(21, "IQ3_S", 256, 110, false),
    T(22, "IQ2_S", 256, 82, false),
    T(23, "IQ4_XS", 256, 136, false),
    T(KERN_I8, "I8", 1, 1, false),
    T(KERN_I16, "I16", 1, 2, false),
    T(KERN_I32, "I32", 1, 4, false),
    T(KERN_I64, "I64", 1, 8, false),
    T(KERN_F64, "F64", 1, 8, false),
    T(29, "IQ1_M", 256, 56, false),
    T(KERN_BF16, "BF16", 1, 2, true),
    T(34, "TQ1_0", 256, 54, false),
    T(35, "TQ2_0", 256, 66, false),
};

const struct kern_type_info *kern_type_info(uint32_t type)
{
    if (type >= KERN_TYPE_LIMIT || type_table[type].name == NULL)
        return NULL;
    return &type_table[type];
}

size_t kern_row_bytes(uint32_t type, int64_t n)
{
    const struct kern_type_info *ti = kern_type_info(type);
    if (ti == NULL || n < 0 || n % ti->block_elems != 0)
        return 0;
    return (size_t)(n / ti->block_elems) * ti->block_bytes;
}
