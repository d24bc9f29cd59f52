from kvarn_math.testing import register_profiles

register_profiles()
