/* The logit transform of a head's options (engine.h): softcap, logit_scale and temperature as one cap and one scale,
 * each applied in fp32. */
#include "engine.h"

#include <float.h>

static int normal_float(double v)
{
    return v >= FLT_MIN && v <= FLT_MAX;
}

fh_status fh_engine_transform(fh_context *ctx, double temperature, double softcap, double logit_scale,
                              fh_transform *tf)
{
    /* 1 / temperature and the cap are applied in fp32: each must be a normal float. */
    if (!(temperature > 0.0 && normal_float(1.0 / temperature)))
        return fh_fail(ctx, FH_ERR_INVALID_TEMPERATURE, "temperature = %g must be > 0 with 1/temperature in fp32 range",
                       temperature);
    if (!(softcap == 0.0 || normal_float(softcap)))
        return fh_fail(ctx, FH_ERR_INVALID_SOFTCAP, "softcap = %g must be 0 (off) or in [%g, %g] (fp32 range)", softcap,
                       (double)FLT_MIN, (double)FLT_MAX);
    if (!normal_float(logit_scale))
        return fh_fail(ctx, FH_ERR_INVALID_LOGIT_SCALE, "logit_scale = %g must be in [%g, %g] (fp32 range)",
                       logit_scale, (double)FLT_MIN, (double)FLT_MAX);
    const double scale = logit_scale / temperature, cap = softcap / logit_scale;
    if (!normal_float(scale) || !(softcap == 0.0 || normal_float(cap)))
        return fh_fail(ctx, FH_ERR_INVALID_LOGIT_SCALE,
                       "logit_scale = %g puts %s = %g outside fp32's normal range", logit_scale,
                       normal_float(scale) ? "softcap / logit_scale" : "logit_scale / temperature",
                       normal_float(scale) ? cap : scale);
    *tf = fh_engine_transform_of(temperature, softcap, logit_scale);
    return FH_OK;
}

fh_transform fh_engine_transform_of(double temperature, double softcap, double logit_scale)
{
    const fh_transform tf = {(float)(softcap / logit_scale), (float)(logit_scale / temperature)};
    return tf;
}
